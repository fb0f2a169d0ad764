"""The CLI's main job: the demo's check and timing paths run (timing on CPU with a wall clock)."""
import torch

from ioattn.__main__ import demo_check, demo_time, main


def test_demo_check_and_time(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    shape = (2, 96, 4, 2, 32)
    assert demo_check(torch.device(device), dtype, shape)
    results = demo_time(torch.device(device), dtype, shape)
    assert set(results["ioattn"]) == {"fwd", "bwd"} and all(ms > 0 for ms in results["ioattn"].values())


def test_info_and_help(capsys):
    assert main(["info"]) == 0
    assert "backend triton" in capsys.readouterr().out
    assert main(["help"]) == 0
    assert main(["nonsense"]) == 2


def test_every_env_switch_is_listed_by_info(capsys):
    """Each IOATTN_* variable the package reads is in dispatch.ENV_SWITCHES, which `info` prints,
    so no kernel variant switch is undocumented."""
    import pathlib
    import re

    import ioattn
    from ioattn.dispatch import ENV_SWITCHES

    root = pathlib.Path(ioattn.__file__).parent
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"environ\.get\(\"(IOATTN_[A-Z0-9_]+)\"", path.read_text()))
    read.discard("IOATTN_GIT_COMMIT")  # benchmark metadata, not a kernel switch
    listed = {name for name, _, _ in ENV_SWITCHES}
    assert read == listed, (read - listed, listed - read)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in listed)
