"""Benchmark harness: ioattn vs. PyTorch attention anchors (``python -m ioattn bench``)."""
