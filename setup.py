"""rlmega: reinforcement-learning post-training of large language models on Megatron-Core."""

from setuptools import find_packages, setup

# Ranges are the ones tested. megatron-core: 0.16 is the newest release for Python 3.11, 0.17 to 0.19 need
# Python >= 3.12, so pip picks 0.16.x on 3.11 and 0.19.x on 3.12; rlmega.parallel.mcore_version names the
# releases every version gate was read against (keep the two in step).
INSTALL_REQUIRES = [
    "torch>=2.6,<2.15",  # 2.14: the torch that vllm 0.33 and sglang 0.5.23 pin
    "megatron-core>=0.16,<0.20",
    # megatron-core 0.18 and 0.19 import triton unconditionally; CUDA builds of torch bring it, CPU builds do not.
    "triton>=3.3,<4; python_version >= '3.12' and sys_platform == 'linux'",
    "transformers>=5.0,<6",
    "ray[default]>=2.40,<3",
    "hydra-core>=1.3.2,<1.4",
    "safetensors>=0.5,<0.9",
    "numpy>=1.26,<3",
    "pyarrow>=16,<27",
    "rich>=13,<16",
    "tqdm>=4.66,<5",
    "psutil>=5.9",  # dist_checkpointing's writer processes require it
    "matplotlib>=3.8,<4",  # the trainer's reward_curve.png (tested with 3.11)
    "tensorboard>=2.14,<3",  # the trainer's tensorboard metrics backend (tested with 2.21)
    "pillow>=10,<14",  # images of vision-language datasets (tested with 13.0)
]

EXTRAS_REQUIRE = {
    # apex is built from NVIDIA's source on GPU clusters (see README); the PyPI "apex" is unrelated.
    # transformer-engine to go with the megatron-core each Python gets (rlmega.parallel.mcore_version's
    # TRANSFORMER_ENGINE): 0.16's own tested range (its "dev" extra) on 3.11; on 3.12, for megatron-core 0.19,
    # 2.12 (the oldest its code expects) through 2.20 (the one that goes with torch 2.14).
    "gpu": ["transformer-engine[pytorch]>=2.9,<2.12; python_version < '3.12'",
            "transformer-engine[pytorch]>=2.12,<2.21; python_version >= '3.12'"],
    "vllm": ["vllm>=0.33,<0.35"],  # 0.34 changed nothing the adapter calls (tests/rollout/fakes/api/vllm-0.34.json)
    "sglang": ["sglang>=0.5.23,<0.5.24"],  # SGLang changes its Python API within 0.5.x
    # sync.transport=sharded_rdt: vLLM's transfer over Ray's direct transport (rlmega/sync/sharded_rdt_needs.py).
    "sharded_rdt": ["vllm>=0.33,<0.35", "ray[default]>=2.56,<3", "nixl>=1.5,<2"],
    # rlmega.gateway: the OpenAI-compatible HTTP gateway in front of the engines (tested with fastapi 0.165,
    # uvicorn 0.55).
    "gateway": ["fastapi>=0.115,<1", "uvicorn>=0.30,<1"],
    "test": ["pytest>=8,<10", "pytest-timeout>=2.3,<3", "hypothesis>=6.100,<7",
             "import-linter>=2.16,<3",  # tests/import_contracts.ini: the layers, checked with the suite
             # the gateway's tests drive it with the real openai client (tested with openai 2.54)
             "fastapi>=0.115,<1", "uvicorn>=0.30,<1", "openai>=1.50,<3", "httpx>=0.27,<1"],
    # benchmarks/peer_trl.py: TRL's GRPOTrainer on the same job. TRL's requirements that rlmega does not
    # already have (tested with accelerate 1.15.0, datasets 5.2.0, pandas 3.1.1); none replaces torch.
    "bench": ["trl==1.16.0", "accelerate>=1.10.1,<2", "datasets>=4.7,<6", "pandas>=2.1.1,<4"],
}

setup(
    name="rlmega",
    version="0.1.0",
    description="Reinforcement-learning post-training of large language models on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["rlmega", "rlmega.*", "converters", "converters.*"]),
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["rlmega=rlmega.cli.main:main"]},
)
