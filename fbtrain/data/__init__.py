"""The data layer: getting a corpus, tokenizing it, splitting it and drawing windows from it.

It knows nothing of training; it imports only :mod:`fbtrain.config`, :mod:`fbtrain.io`,
:mod:`fbtrain.filelock` and :mod:`fbtrain.rng`. Import each name from the module that owns
it (nothing is re-exported here):

- :mod:`~fbtrain.data.errors`: ``DataError`` (every user-facing data problem), ``one_line``;
- :mod:`~fbtrain.data.streams`: ``Stream`` (a split's inputs and targets), ``window``,
  ``split``, ``IGNORE_INDEX``;
- :mod:`~fbtrain.data.samplers`: ``BatchSampler`` (random training windows),
  ``SegmentReader`` (contiguous streams for carried memory), ``fixed_windows`` (evaluation);
- :mod:`~fbtrain.data.tokenizers`: char, word and byte tokenizers, ``Decoder`` (ids to text
  one at a time);
- :mod:`~fbtrain.data.fetch`: download (timeout, deadline, retries, sha256), cache, ``CacheLock``;
- :mod:`~fbtrain.data.text`: a plain-text corpus (``data.path`` or a cached download);
- :mod:`~fbtrain.data.sources`, :mod:`~fbtrain.data.archives` (enwik8, text8),
  :mod:`~fbtrain.data.algorithmic` (the state-tracking programs);
- :mod:`~fbtrain.data.corpus`: a dataset as the trainer sees it, a tokenizer and named splits.
"""
