"""The wire contract's error table and models."""

import pytest
from pydantic import ValidationError

from rdzv_common.protocol import (
    AGENT_MESSAGE,
    ERROR_CLASSES,
    ERROR_STATUS,
    ErrorCode,
    JobSpec,
    SpecMismatchError,
    error_from_body,
)


def test_every_code_has_a_status_and_a_client_exception():
    """The one mapping table is complete: every code maps to a 4xx/5xx and a class."""
    for code in ErrorCode:
        assert 400 <= ERROR_STATUS[code] < 600
        err = error_from_body(code.value, "x")
        assert type(err) is ERROR_CLASSES[code] and err.code == code and err.status == ERROR_STATUS[code]


def test_client_maps_by_code_not_message():
    """A server error body becomes the matching exception whatever its text."""
    err = error_from_body("spec_mismatch", "anything")
    assert isinstance(err, SpecMismatchError)
    assert error_from_body("no_such_code", "m").code == ErrorCode.BAD_REQUEST


def test_spec_refuses_min_above_max():
    """min_nodes > max_nodes is refused with both values named."""
    with pytest.raises(ValidationError, match=r"min_nodes \(5\) is greater than max_nodes \(2\)"):
        JobSpec(min_nodes=5, max_nodes=2)


@pytest.mark.parametrize(
    "frame",
    [
        '{"op":"join"}',
        '{"op":"nope"}',
        '{"op":"hb","extra":1}',
        '{"op":"failed","round":-1,"failures":[]}',
        "[]",
        "not json",
    ],
)
def test_bad_agent_frames_are_refused(frame):
    """Unknown ops, unknown fields, negative rounds and junk do not parse."""
    with pytest.raises(ValidationError):
        AGENT_MESSAGE.validate_json(frame)


def test_printable_escapes_control_characters():
    from rdzv_common.protocol import printable

    assert printable("plain text: ok") == "plain text: ok"
    assert printable("forged\n2026-01-01 INFO line") == "forged\\n2026-01-01 INFO line"
    assert printable("\x1b[2J\x1b]0;title\x07") == "\\x1b[2J\\x1b]0;title\\x07"
    assert printable("nul\x00 del\x7f csi\x9b") == "nul\\x00 del\\x7f csi\\x9b"
    assert "\n" not in printable("a\r\nb") and "\r" not in printable("a\r\nb")
    assert printable("x" * 50, limit=10) == "xxxxxxx..."


def test_printable_escapes_bidi_and_invisible_characters():
    """A job id or reason cannot read as another (``evil\u202egnp.exe``) nor hide
    text (zero-width): every format character (Unicode Cf) of this Python's
    database, the line/paragraph separators and the blank fillers are escaped;
    letters of any script are kept."""
    import sys
    import unicodedata

    from rdzv_common.protocol import printable

    assert printable("job\u202egnp.exe") == "job\\u202egnp.exe"
    assert printable("a\u200bb\u200dc\u2060d\ufeffe") == "a\\u200bb\\u200dc\\u2060d\\ufeffe"
    assert printable("\u2066x\u2069 \u200e\u200f\u061c") == "\\u2066x\\u2069 \\u200e\\u200f\\u061c"
    assert printable("tag\U000e0041") == "tag\\U000e0041"
    assert printable("line\u2028sep") == "line\\u2028sep"
    assert printable("été 東京 Ωmega") == "été 東京 Ωmega"
    invisible = [chr(n) for n in range(sys.maxunicode + 1) if unicodedata.category(chr(n)) in ("Cf", "Zl", "Zp")]
    assert len(invisible) > 150
    raw = [c for c in invisible if c in printable(c)]
    assert not raw, [f"U+{ord(c):04X}" for c in raw]


def test_heartbeat_frame_is_what_a_heartbeat_serializes_to():
    """The server compares frames to HEARTBEAT_FRAME before parsing: the text
    must be exactly a HeartbeatMsg's JSON, and parse back to one."""
    from rdzv_common.protocol import HEARTBEAT_FRAME, HeartbeatMsg

    assert HeartbeatMsg().model_dump_json() == HEARTBEAT_FRAME
    assert isinstance(AGENT_MESSAGE.validate_json(HEARTBEAT_FRAME), HeartbeatMsg)


def test_error_tree_names_every_error_class_and_protocol_reexports_them():
    """The error tree in rdzv_common.errors lists every RdzvError subclass of
    the server, and each is importable from rdzv_common.protocol too."""
    import inspect

    from rdzv_common import errors, protocol
    from rdzv_server import store

    classes = {
        c for m in (errors, store) for _, c in inspect.getmembers(m, inspect.isclass) if issubclass(c, errors.RdzvError)
    }
    assert {c.__name__ for c in classes} >= {
        "RdzvError",
        "RequestError",
        "JobNotFinishedError",
        "NodeSecretMismatchError",
        "JobSecretMismatchError",
        "DataDirError",
    }
    tree = errors.__doc__.split("::", 1)[1]
    for c in classes:
        assert f"+-- {c.__name__} " in tree or tree.lstrip().startswith(c.__name__ + " "), c.__name__
    for name in dir(errors):
        if not name.startswith("_") and name not in ("annotations", "Enum"):
            assert getattr(protocol, name) is getattr(errors, name), name
