"""A trained retriever in use: loaded from its checkpoint, retrieving, answering.

- :mod:`~car_fl.serving.checkpoint`: ``load_retriever`` from a checkpoint folder.
- :mod:`~car_fl.serving.blocks_service`: the frozen blocks of a model on Ray Serve, for many nodes.
- :mod:`~car_fl.serving.ray_app`: what every Ray Serve app shares (settings, start, stop, flags).
- :mod:`~car_fl.serving.admission`: what Serve's proxy admits (whole bodies, caps, a drain).
- :mod:`~car_fl.serving.header_deadline`: a deadline on request headers in its uvicorn.
- :mod:`~car_fl.serving.retrieval_api`: the retrieval endpoint's schema, checks and FastAPI app.
- :mod:`~car_fl.serving.retrieval_service`: that endpoint on Ray Serve (``car-fl serve``).
- :mod:`~car_fl.serving.retrieval_client`: in-process or endpoint, for the framework retrievers.
- :mod:`~car_fl.serving.langchain_retriever`: a LangChain ``BaseRetriever`` (extra: langchain).
- :mod:`~car_fl.serving.llamaindex_retriever`: a LlamaIndex ``BaseRetriever`` (extra: llamaindex).
- :mod:`~car_fl.serving.rag`: the top-K documents, a prompt, a causal LM's answer.
- :mod:`~car_fl.serving.query_generation`: training queries the causal LM writes, filtered.
"""
