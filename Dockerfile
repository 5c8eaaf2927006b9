# gentrain training image: the CUDA build of the torch release the test suite runs
# (scripts/test.sh installs the same version as its CPU build; tests/test_deploy.py fails
# when the two drift apart) + gentrain with every extra a GPU run can turn on: a run cannot
# pip-install into its pod, so a missing one is an exit 2 on the cluster (tests/test_image_extras.py
# derives each preset's and each GPU lever's extras from its config and checks them against the line below).
# Used by the TorchX component (`bash -c "python -m trainer launch ..."`) and by k8s/ manifests.
FROM python:3.11-slim-bookworm

# PyPI's Linux x86_64 wheel of torch 2.13.0 is the CUDA 13.0 build: the CUDA runtime,
# cuDNN and NCCL come as nvidia-* wheels, so only the node's driver (>= 580) is needed.
ARG TORCH_VERSION=2.13.0
# Another CUDA build of the same torch release, for nodes with an older driver: its PyTorch
# wheel index, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (CUDA
# 12.6, driver >= 525.60.13; k8s/README.md lists each build's driver). Empty: PyPI.
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/work \
    TMPDIR=/tmp \
    HF_HOME=/tmp/hf \
    MPLCONFIGDIR=/tmp/mpl

WORKDIR /opt/gentrain

# torch in a layer of its own: the biggest one, rebuilt only when TORCH_VERSION or
# TORCH_INDEX_URL change. The index replaces PyPI for this step only (PIP_INDEX_URL is pip's
# --index-url, not --extra-index-url): torch and its nvidia-* wheels all come from it, never
# PyPI's CUDA 13 build of the same version.
RUN if [ -n "${TORCH_INDEX_URL}" ]; then export PIP_INDEX_URL="${TORCH_INDEX_URL}"; fi \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}"

# Dependencies in their own layer: rebuilt only when pyproject.toml or constraints-runtime.txt change.
# torch is already installed at TORCH_VERSION (it satisfies torch>=2.9 and stays as it is;
# torch==2.13.0 also matches an index's local version such as 2.13.0+cu126). constraints-runtime.txt,
# not the test environment's constraints.txt: no TorchX here, so urllib3 is current.
# The extras: s3, gcs (stores), video (PyAV), eval (FID/KID), etcd (torchrun's etcd rendezvous),
# lowbit (train.optimizer=adamw8bit) and float8 (train.float8; both torchao), text (captions:
# sentence-transformers + the shipped encoder, which mmdit-512 uses), trackers (log.report_to:
# tensorboard, wandb, mlflow), hf (data.source=hf), lora (model.lora: peft). train.compile needs
# none: inductor and triton come with the torch wheel. Left out: inception (torch-fidelity needs a
# torchvision built for this exact torch/CUDA build, and torchmetrics imports it whenever it is
# installed, so a mismatched one breaks every FID), torchx (runs where jobs are submitted, and pins
# urllib3<1.27), docs and test (development tools).
COPY pyproject.toml constraints-runtime.txt README.md ./
RUN mkdir -p trainer/presets trainer/data \
    && touch trainer/__init__.py \
    && pip install --no-cache-dir -c constraints-runtime.txt "torch==${TORCH_VERSION}" \
        ".[s3,gcs,video,eval,etcd,lowbit,float8,text,trackers,hf,lora]" \
    && pip uninstall -y gentrain

# The code: small and changes often.
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps . \
    && useradd -l --uid 1000 --create-home --home-dir /work gentrain

USER 1000:1000
WORKDIR /work
# 29500: torchrun c10d rendezvous; 9090: Prometheus metrics (local rank 0).
EXPOSE 29500 9090
CMD ["gentrain", "presets"]
