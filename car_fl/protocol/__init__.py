"""The protocol (both parties): what crosses the wire between the server and a node.

- :mod:`~car_fl.protocol.messages`: the tensor codec, the train instruction and the reply.
- :mod:`~car_fl.protocol.wire`: a whole message's bytes (``encode_content``), without torch.
- :mod:`~car_fl.protocol.failures`: what a node sends instead of an update: fixed code and text.
"""
