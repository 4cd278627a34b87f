"""Reference of the prefix-sum task: inputs, the expected output, and the check."""
import itertools
import random


def generate_input(size, seed):
    """`size` integers in [-1000, 1000], reproducible from `seed`."""
    rng = random.Random(seed)
    return [rng.randint(-1000, 1000) for _ in range(size)]


def ref_kernel(data):
    """Inclusive prefix sum: out[i] = data[0] + ... + data[i]."""
    return list(itertools.accumulate(data))


def check_implementation(data, expected, output):
    """(passed, message): the output must equal the reference exactly (integers)."""
    if not isinstance(output, list):
        return False, f"expected a list, got {type(output).__name__}"
    if len(output) != len(expected):
        return False, f"expected {len(expected)} values, got {len(output)}"
    for i, (got, want) in enumerate(zip(output, expected)):
        if got != want:
            return False, f"mismatch at index {i}: expected {want}, got {got}"
    return True, ""
