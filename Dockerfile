# gentrain training image: CUDA PyTorch runtime + gentrain with S3/GCS support.
# Used by the TorchX component (which runs `bash -c "torchrun ..."`) and by k8s/ manifests.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/work \
    TMPDIR=/tmp \
    HF_HOME=/tmp/hf \
    MPLCONFIGDIR=/tmp/mpl

WORKDIR /opt/gentrain

# Dependencies in their own layer: rebuilt only when pyproject.toml or constraints.txt change.
# torch comes from the base image (torch>=2.4 is already satisfied).
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir -p trainer/presets trainer/data \
    && touch trainer/__init__.py \
    && pip install --no-cache-dir -c constraints.txt ".[s3,gcs]" \
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
