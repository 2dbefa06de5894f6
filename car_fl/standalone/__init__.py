"""A run on one machine without Flower: the centralised epoch loop.

- :mod:`~car_fl.standalone.centralized`: centralised training, one row of metrics per epoch.
"""
