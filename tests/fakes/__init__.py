"""Named fakes of what a CPU machine lacks (CUDA, TensorRT): each records what the code under test asks of it and
answers as the real library documents, so the tests can check the calls without a GPU."""
