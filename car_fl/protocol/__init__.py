"""The protocol (both parties): what crosses the wire between the server and a node.

- :mod:`~car_fl.protocol.messages`: the raw tensor codec (``encode``/``decode``,
  ``to_record``/``from_record``), the train instruction (``read_train_message``) and the reply
  (``train_reply``), their record keys.
- :mod:`~car_fl.protocol.wire`: a whole message's bytes (``encode_content``), without torch.
- :mod:`~car_fl.protocol.failures`: what a node sends instead of an update: a fixed code,
  fixed text.
"""
