"""profile_kernels.py's arithmetic (the script itself needs CUDA)."""

from load_tests.profile_kernels import busy_us, parse_args


def test_busy_is_the_union_of_the_kernel_intervals() -> None:
    # overlapping, nested, touching and disjoint intervals, out of order
    spans = [(10.0, 20.0), (0.0, 5.0), (12.0, 15.0), (18.0, 25.0), (25.0, 26.0), (40.0, 41.5)]
    assert busy_us(spans) == 5.0 + 16.0 + 1.5
    assert busy_us([]) == 0.0


def test_batch_sizes_parse() -> None:
    assert parse_args(["--model-dir", "m", "--batch-sizes", "1,8"]).batch_sizes == [1, 8]
