"""Packaging for hvdkit.

``pip install hvdkit`` goes into an environment that already has TensorFlow
and leaves it alone: there is no TensorFlow requirement (``tensorflow`` and
``tensorflow-cpu`` share one import name, and pip cannot see from inside its
build which one the user has), no Horovod requirement (PyPI has only Horovod's
source, which pip would compile in an isolated build without TensorFlow, so
without its TensorFlow extension), and no TensorBoard or protobuf constraint.
After it, ``python -m hvdkit install-horovod`` builds Horovod for the installed
TensorFlow and ``hvdkit doctor`` says what works. On a machine without
TensorFlow, ``pip install 'hvdkit[cpu]'`` (or ``[gpu]``) brings a supported one.

The supported TensorFlow range has one home, ``SUPPORTED_TENSORFLOW`` in
hvdkit/_compat.py, read here without importing hvdkit.
"""

import ast
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def _compat_constant(name: str) -> str:
    tree = ast.parse((HERE / "hvdkit" / "_compat.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"hvdkit/_compat.py defines no {name}")


TF_SPEC = _compat_constant("SUPPORTED_TENSORFLOW")

setup(
    name="hvdkit",
    version="0.1.0",
    description="Data-parallel training for TensorFlow 2 / Keras 3 on Horovod (MPI, Gloo)",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # Tested on 3.11 only (the one Python of the test machines); 3.12/3.13 are
    # untested, not known to fail: docs/install.md says how to try them.
    python_requires=">=3.11,<3.12",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Operating System :: POSIX :: Linux",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Development Status :: 3 - Alpha",
    ],
    packages=find_packages(include=["hvdkit", "hvdkit.*"]),
    package_data={"hvdkit": ["patches/*.patch"]},  # applied by python -m hvdkit install-horovod
    install_requires=[
        # TensorFlow 2.18-2.21 bring Keras >= 3.5; hvdkit's Keras hooks are checked on 3.10-3.15
        "keras>=3.10,<4",
        "numpy>=1.26",
        "psutil>=5.9",
    ],
    extras_require={
        # only for an environment without TensorFlow: either one, never both
        "cpu": ["tensorflow-cpu" + TF_SPEC],
        "gpu": ["tensorflow[and-cuda]" + TF_SPEC],
        # hvdkit.spark.run / hvdkit.ray.run: the engine of the user's cluster (tested versions)
        "spark": ["pyspark>=3.5"],
        "ray": ["ray>=2.9"],
        "test": [
            "pyspark==4.3.0",  # tests/test_spark.py's cluster (needs Java 17)
            "pyarrow",  # the ranks read a DataFrame's Parquet files (docs/spark.md)
            "ray==2.60.0",  # tests/test_ray.py's cluster
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "scikit-learn>=1.4",
            "ruff==0.17.6",
            # keras.callbacks.TensorBoard needs it; TF 2.21 no longer installs it,
            # TF 2.18-2.20 install their own, which this range keeps
            "tensorboard>=2.18,<3",
        ],
    },
    entry_points={
        "console_scripts": [
            "hvdkitrun = hvdkit.launch:main",
            "hvdkit = hvdkit.__main__:main",
        ]
    },
)
