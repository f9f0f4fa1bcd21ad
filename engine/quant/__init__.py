"""Quantized weights (#31): the schemes (`scheme.py`), the checkpoint formats that carry them (`formats.py`), the
kernels that multiply by them (`kernels.py`) and the linear layer that holds one (`layer.py`)."""
