from setuptools import find_packages, setup

setup(
    name="galaxy",
    version="0.1.0",
    description="Hybrid-parallel training and fine-tuning of BERT and LLaMA: per-block TP / SP / None plans, "
                "DP and PP, PEFT, and a FLOPs profiler",
    python_requires=">=3.10",
    packages=find_packages(include=["galaxy", "galaxy.*"]),
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "tokenizers",
        "tqdm",
    ],
    entry_points={"console_scripts": ["galaxy = galaxy.cli.main:main"]},
    extras_require={
        # bitsandbytes: the NF4/int8 tests compare with its CPU quantize/dequantize; its wheels with a CPU
        # backend install on Linux x86_64 (0.50 checked); elsewhere those tests skip.
        "test": ["pytest", "pytest-xdist", "transformers>=4.44", "peft", "deepspeed", "matplotlib", "tensorboard",
                 "triton>=3.7; platform_system=='Linux'",
                 # torchao: bench_train's float8 rows (torchtitan's float8 recipe) and Galaxy's float8_training
                 "torchao>=0.17",
                 "bitsandbytes>=0.50; platform_system=='Linux' and platform_machine=='x86_64'"],
        "plot": ["matplotlib"],
        "gpu": ["triton>=3.2"],
        "profile": ["deepspeed"],
        "tensorboard": ["tensorboard"],
    },
)
