from setuptools import find_packages, setup

setup(
    name="rlver_jax",
    version="0.1.0",
    description="RLVER (RL with verifiable emotion rewards) in JAX/Flax for TPU and GPU meshes",
    python_requires=">=3.10",
    packages=find_packages(include=["rlver_jax*", "models*", "rl*", "sim_user*", "configs*"]),
    package_data={"sim_user": ["prompts/*", "data/*"], "configs": ["*.jsonl"],
                  "models": ["assets/gpu_target_configs/*"],
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
        "tensorboard",  # the README's `tensorboard --logdir` viewer
        "matplotlib",
    ],
    extras_require={
        # torch is the reference for parity tests only; install the CPU wheel
        # first (see README) so pip does not pull a CUDA build.
        "test": ["pytest", "hypothesis", "torch"],
        "bench": ["torch", "google-tunix"],
        # libtpu: compile for TPU slices on any machine (python -m rlver_jax.plan --topology=…),
        # and run on a TPU VM.
        "tpu": ["jax[tpu]"],
        # the CUDA plugin: compile for H100/H200 with no GPU (--topology=h200-8), run on GPUs.
        "gpu": ["jax[cuda12]"],
    },
)
