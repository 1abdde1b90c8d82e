from setuptools import find_packages, setup

setup(
    name="rlver_jax",
    version="0.1.0",
    description="RLVER (RL with verifiable emotion rewards) in JAX/Flax for TPU and GPU meshes",
    python_requires=">=3.10",
    packages=find_packages(include=["rlver_jax*", "infra*", "models*", "rl*", "sim_user*", "configs*"]),
    package_data={"sim_user": ["prompts/*", "data/*"], "configs": ["*.jsonl"],
                  "infra": ["assets/gpu_target_configs/*"],
                  "rlver_jax": ["assets/*", "assets/tiny_tokenizer/*"]},
    install_requires=[
        "jax>=0.6",
        "flax>=0.12",
        "optax",
        "orbax-checkpoint",
        "transformers>=4.45",
        "jinja2",  # transformers' apply_chat_template renders the chat templates with it
        "tokenizers",
        "sentencepiece",
        "tensorflow-datasets",
        "ml-collections",
        "absl-py",
        "ml_dtypes",
        "numpy",
        "tqdm",
        "tensorboardX",
        "tensorboard",  # the `tensorboard --logdir` viewer a run names (docs/demo.md)
        "matplotlib",
    ],
    extras_require={
        # torch is the reference for parity tests only; install the CPU wheel
        # first (see docs/testing.md) so pip does not pull a CUDA build.
        # pytest-xdist: the README's test command runs the suite on two workers (`-n 2`).
        "test": ["pytest", "pytest-xdist", "hypothesis", "torch"],
        # Pinned so pip resolves at once: unpinned, google-tunix 0.1.7's safetensors<0.8 clashes
        # with transformers>=5.13, and pip backtracks for minutes through tunix, transformers and
        # datasets down to pyarrow 3.0.0 / numpy 1.19.4, which fail to build. transformers 5.12.1
        # is the newest that takes safetensors<0.8; the lower bounds keep datasets, pyarrow and
        # numpy on wheels. Install the CPU torch first (bench/README.md), or torch brings a CUDA build.
        "bench": ["torch", "google-tunix==0.1.7", "transformers==5.12.1", "safetensors<0.8",
                  "datasets>=5.2", "pyarrow>=24", "numpy>=2"],
        # libtpu: compile for TPU slices on any machine (python -m rlver_jax.plan --topology=…),
        # and run on a TPU VM.
        "tpu": ["jax[tpu]"],
        # the CUDA plugin: compile for H100/H200 with no GPU (--topology=h200-8), run on GPUs.
        "gpu": ["jax[cuda12]"],
    },
)
