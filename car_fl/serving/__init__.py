"""A trained retriever in use: loaded from its checkpoint, retrieving, answering.

- :mod:`~car_fl.serving.checkpoint`: ``load_retriever`` from a checkpoint folder.
- :mod:`~car_fl.serving.blocks_service`: the frozen blocks of a model on Ray Serve, for many nodes.
- :mod:`~car_fl.serving.rag`: the top-K documents, a prompt, a causal LM's answer.
- :mod:`~car_fl.serving.query_generation`: training queries the causal LM writes, kept by a
  round trip through the retriever.
"""
