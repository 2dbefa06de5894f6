"""car-fl's tests, one package per package of car_fl (the top level: entry points)."""

TESTED_ELSEWHERE: dict[str, str] = {}
