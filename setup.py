"""Packaging for hvdkit.

TensorFlow comes as two distributions with the same import name: ``tensorflow``
(GPU-capable) and ``tensorflow-cpu``. We require whichever one is already
installed, and ``tensorflow-cpu`` on a machine that has neither, so that
``pip install -e .`` never pulls a second multi-GB TensorFlow next to the first.
Horovod has no wheels on PyPI: build it first with ``scripts/install.sh``.
"""

from importlib import metadata

from setuptools import find_packages, setup

TF_SPEC = "==2.21.*"


def _tensorflow_requirement() -> str:
    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return dist + TF_SPEC
    return "tensorflow-cpu" + TF_SPEC


setup(
    name="hvdkit",
    version="0.1.0",
    description="Data-parallel training for TensorFlow 2 / Keras 3 on Horovod (MPI, Gloo)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["hvdkit", "hvdkit.*"]),
    install_requires=[
        _tensorflow_requirement(),
        "keras>=3.10,<4",
        "numpy>=1.26",
        "mpi4py>=3.1",
        "horovod==0.28.1",
        "cloudpickle>=2.0",
        "psutil>=5.9",
        # keras.callbacks.TensorBoard needs it; TensorFlow 2.21 no longer installs it
        "tensorboard>=2.20,<3",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "scikit-learn>=1.4",
            "ruff==0.17.6",
        ],
        "gpu": ["tensorflow[and-cuda]" + TF_SPEC],
    },
    entry_points={"console_scripts": ["hvdkitrun = hvdkit.launch:main"]},
)
