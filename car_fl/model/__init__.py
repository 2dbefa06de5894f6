"""The retriever's model: the frozen encoder, the adapter, features, and the assembled retriever.

- :mod:`~car_fl.model.encoder`: the frozen encoder (``load_encoder``, ``Encoder``), device, dtype.
- :mod:`~car_fl.model.loading`: a model's weights loaded, and load errors that say what to do.
- :mod:`~car_fl.model.blockless`: a node's embeddings and norm, linked to remote blocks.
- :mod:`~car_fl.model.sources`: where the encoder and data come from, checked before any work.
- :mod:`~car_fl.model.gguf`: GGUF files dequantised once into a Hugging Face folder.
- :mod:`~car_fl.model.features`: length-bucketed extraction (``prepare_for``, ``LocalData``);
  the documents a run retrieves and their frozen embeddings.
- :mod:`~car_fl.model.feature_cache`: the per-text feature cache (``FeatureCache``).
- :mod:`~car_fl.model.retriever`: ``CaRRetriever`` (encoder → adapter → pooling → scorer),
  features scaled by the documents' statistics, ``build_retriever`` from the settings and the
  corpus alone.
"""
