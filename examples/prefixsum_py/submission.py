#!POPCORN leaderboard prefixsum_py
"""A correct submission: one running total."""


def custom_kernel(data: list[int]) -> list[int]:
    total = 0
    out = []
    for x in data:
        total += x
        out.append(total)
    return out
