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
