"""Example submission: element-wise vector add."""


def custom_kernel(a, b):
    return [x + y for x, y in zip(a, b)]
