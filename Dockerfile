# pagedserve on CPU: torch first (pinned), then the project. Models are mounted at /models/model.
# EXTRAS=dynamo adds NVIDIA Dynamo's runtime for `pagedserve worker` and `serve --router dynamo` (deploy/).
FROM python:3.11-slim
WORKDIR /app
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md constraints.txt ./
COPY service service
COPY runtime runtime
COPY kernels kernels
COPY config config
ARG EXTRAS=""
RUN pip install --no-cache-dir -c constraints.txt ".${EXTRAS:+[$EXTRAS]}"
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready').status != 200)"
CMD ["pagedserve", "serve", "--model", "/models/model", "--host", "0.0.0.0", "--port", "8000"]
