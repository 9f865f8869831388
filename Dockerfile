# The image of the xpk and JobSet modes (launch/gcp/commands.py, docs/cloud_tpu.md): the project
# at /opt/reasoning_rl/src and its environment at /opt/reasoning_rl/venv, made by the same
# install script as on TPU VM workers (own Python env with uv, jax[tpu]==0.10.2 with its libtpu).
#   docker build --platform=linux/amd64 -t us-docker.pkg.dev/PROJECT/REPO/reasoning_rl:COMMIT . \
#     && docker push us-docker.pkg.dev/PROJECT/REPO/reasoning_rl:COMMIT
# commands.py prints this line with COMMIT filled in (the checkout's commit, plus a digest of its
# code when it has uncommitted changes) and runs that image: an image is the code it was built
# from. --platform: TPU hosts are linux/amd64; without it an arm64 laptop builds an arm64 image.
# The same image is the base of xpk's own build (commands.py --mode=xpk --base_image=IMAGE: xpk
# copies the repository into /app of an image FROM this one and runs the trainer there with
# /opt/reasoning_rl/venv); rebuild it when setup.cfg's dependencies change. linux/amd64: the
# platform xpk builds TPU images for (google/xpk system_characteristics.py, DockerPlatform).
FROM python:3.12-slim
RUN apt-get update && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*
COPY . /opt/reasoning_rl/src
RUN bash /opt/reasoning_rl/src/launch/gcp/install_worker.sh \
        /opt/reasoning_rl/src /opt/reasoning_rl \
    && rm -rf /root/.cache
WORKDIR /opt/reasoning_rl/src
ENV PATH=/opt/reasoning_rl/venv/bin:$PATH
CMD ["python", "launch/train.py", "--helpfull"]
