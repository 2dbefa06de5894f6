"""car-fl: federated, differentially private Classifier-as-Retriever training with Flower."""

__version__ = "0.1.0"
