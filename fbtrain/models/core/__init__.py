"""The sequential core of the Feedback Transformer: its contract (``spec``), the C++ core
(``native``), the PyTorch fallback (``python``), which of the two runs (``select``) and the
autograd Function around them (``autograd``). See ``spec`` for why the core exists."""
