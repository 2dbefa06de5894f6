"""A run on one machine without Flower: the centralised epoch loop and its resume.

- :mod:`~car_fl.standalone.centralized`: centralised training, one row of metrics per epoch.
- :mod:`~car_fl.standalone.resume`: a stopped run continued from its last epoch (``resume=``).
"""
