"""What every format's torch-free quick part (formats/*/quick*.py) shares for `ckptool inspect`: torch
files and DCP metadata read for their structure without torch (torch_pickle.py), and tensors as shapes and
dtype names with the canonical shapes a GPTConfig implies (meta.py). The dispatch is quick_inspect.py."""
