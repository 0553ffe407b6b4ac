"""Training metrics behind one facade (:class:`fbtrain.metrics.logger.MetricsLogger`).

- :mod:`.logger`: the facade the trainer talks to, and ``metrics.jsonl``;
- :mod:`.tensorboard`: the TensorBoard events (scalars, text, the layout, HParams);
- :mod:`.console`: what the terminal shows (the progress line, messages, ETA).
"""
