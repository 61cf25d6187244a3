# syntax=docker/dockerfile:1
# weightship images, built from this repository's own files (`make images`):
#
#   target `weightship` (default): control plane, node agent / cache and operator entry points
#       weightship-controlplane · weightship-agent · weightship-operator · weightship (CLI)
#   target `serve`: the reference model server `weightship-serve`, with torch==2.13.0 and transformers
#       CPU build by default; the CUDA build with --build-arg TORCH_INDEX_URL=https://pypi.org/simple
#       (PyPI's Linux x86_64 torch wheels are the CUDA builds; the NVIDIA driver comes from the node).
#
# Versions: every package is pinned by requirements.txt, used as a constraints file, so an image
# holds exactly the versions the test suite ran against. Test-only packages are never installed.
# Both images run as UID/GID 10001 (`weightship`), which is also the UID model-server pods use
# to reach the agent's local API socket (docs/kubernetes.md).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Dependencies first, in their own layer, so editing code does not install them again: the list
# is pyproject.toml's (with the operator's extra: its Kubernetes client and kopf), and the package
# itself is installed after the code, without them. pip refuses extras in a constraints file:
# strip them (psycopg[binary] -> psycopg; the list asks for the extras it needs).
COPY requirements.txt pyproject.toml README.md ./
RUN sed -E 's/\[[^]]*\]//' requirements.txt > /tmp/constraints.txt \
 && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['operator']))" > /tmp/dependencies.txt \
 && python -m venv /opt/weightship \
 && /opt/weightship/bin/pip install -q --upgrade pip \
 && /opt/weightship/bin/pip install -q -c /tmp/constraints.txt -r /tmp/dependencies.txt
COPY weightship/ weightship/
COPY controlplane/ controlplane/
COPY agent/ agent/
COPY gpu_loader/ gpu_loader/
RUN /opt/weightship/bin/pip install -q --no-deps . \
 && /opt/weightship/bin/pip check \
 && /opt/weightship/bin/python -c "import controlplane.__main__, agent.__main__, weightship.cli, kopf"

FROM build AS build-serve
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch exactly as documented: ==2.13.0; a looser range can pull a multi-GB build by surprise.
# transformers and tokenizers: weightship-serve builds any model they know (docs/serving.md).
RUN /opt/weightship/bin/pip install -q --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        -c /tmp/constraints.txt "torch==2.13.0" "transformers==5.24.0" "tokenizers==0.23.3" \
 && /opt/weightship/bin/python -c "import gpu_loader.serve, gpu_loader.hf, transformers"

FROM ${PYTHON_IMAGE} AS runtime-base
ENV PATH=/opt/weightship/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/home/weightship
RUN groupadd --system --gid 10001 weightship \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/weightship --create-home --shell /usr/sbin/nologin weightship
WORKDIR /home/weightship
USER 10001:10001

FROM runtime-base AS serve
COPY --from=build-serve /opt/weightship /opt/weightship
EXPOSE 8000
ENTRYPOINT ["weightship-serve"]
CMD ["--help"]

# The default target comes last, so a plain `docker build .` builds the main image.
FROM runtime-base AS weightship
COPY --from=build /opt/weightship /opt/weightship
EXPOSE 8080 7071
# No ENTRYPOINT: the chart names the program per workload (controlplane, agent, operator).
CMD ["weightship-controlplane", "serve", "--host", "0.0.0.0", "--port", "8080"]
