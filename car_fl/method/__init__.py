"""The method (both parties): the CaR retriever, its training and its evaluation.

- :mod:`~car_fl.method.encoder`: the frozen encoder (``load_encoder``, ``Encoder``), device and
  dtype; :mod:`~car_fl.method.adapter`: the soft-embedding adapter.
- :mod:`~car_fl.method.head`, :mod:`~car_fl.method.scorers`, :mod:`~car_fl.method.retrieval`:
  the classifier head, one scorer per retrieval method (CaR, MIPS, kNN), their scores;
  :mod:`~car_fl.method.standardize`: features scaled by the documents' statistics;
  :mod:`~car_fl.method.lexical`, :mod:`~car_fl.method.fusion`: BM25 over the documents and its
  ranking fused with the head's.
- :mod:`~car_fl.method.model`: ``CaRRetriever`` (encoder → adapter → pooling → scorer);
  :mod:`~car_fl.method.build`: ``build_retriever``; :mod:`~car_fl.method.serving`:
  ``load_retriever`` from a checkpoint.
- :mod:`~car_fl.method.features`: length-bucketed extraction (``prepare_for``, ``LocalData``);
  :mod:`~car_fl.method.feature_cache`: the per-text feature cache (``FeatureCache``).
- :mod:`~car_fl.method.train`, :mod:`~car_fl.method.metrics`: epochs (DP-SGD included) and
  their torch.optim optimisers, top-K/MRR/F1; :mod:`~car_fl.method.evaluation`:
  ``HeldOut`` (validation and test).
- :mod:`~car_fl.method.centralized`: centralised training, one row of metrics per epoch;
  :mod:`~car_fl.method.resume`: a stopped run continued from its last epoch (``resume=``).
- :mod:`~car_fl.method.probe`: linear probing, the head alone on frozen features, the epoch
  validation selects kept, before adapter + classifier trains.
- :mod:`~car_fl.method.sources`: where the encoder and data come from, checked before any work;
  :mod:`~car_fl.method.gguf`: GGUF files dequantised once into a Hugging Face folder.
- :mod:`~car_fl.method.documents`, :mod:`~car_fl.method.document_head`: the documents a run
  retrieves and the head whose rows start as their embeddings.
- :mod:`~car_fl.method.experts`, :mod:`~car_fl.method.clustering`: the mixture of experts and
  its balanced clusters of documents.
- :mod:`~car_fl.method.rag`: the top-K documents, a prompt, a causal LM's answer;
  :mod:`~car_fl.method.query_generation`: training queries the causal LM writes, kept by a
  round trip through the retriever.
"""
