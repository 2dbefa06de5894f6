"""The heads: what turns a pooled feature into a score per document, one module per head
(CaR's classifier beside the interface, in ``scorer``).

- :mod:`~car_fl.heads.config`: each ``head.kind``'s one registration (its traits, its scorer,
  the approaches it forms) and the ``head`` and ``moe`` settings sections; no torch.
- :mod:`~car_fl.heads.scorer`: the interface every head implements (``Scorer``), a head built
  from its kind's scorer (``build_scorer``), CaR's classifier head and top-K.
- :mod:`~car_fl.heads.document_head`: the head whose rows start as the documents' embeddings.
- :mod:`~car_fl.heads.experts`, :mod:`~car_fl.heads.clustering`: the mixture of experts and its
  balanced clusters of documents.
- :mod:`~car_fl.heads.retrieval`: MIPS and kNN, their scores and scorers.
- :mod:`~car_fl.heads.lexical`, :mod:`~car_fl.heads.fusion`: BM25 and its fusion with the head.
"""
