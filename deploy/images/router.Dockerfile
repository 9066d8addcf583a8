# The router: agentkv with its server extra on a slim Python, running as an unprivileged user.
#   docker build -f deploy/images/router.Dockerfile -t agentkv-router:0.1.0 .   (from the repository root)
FROM python:3.11-slim-bookworm

COPY pyproject.toml README.md /opt/agentkv/
COPY agentkv /opt/agentkv/agentkv
RUN pip install --no-cache-dir "/opt/agentkv[server]" \
    && rm -rf /opt/agentkv

# A numeric user: the chart's runAsNonRoot can only check a number.
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["agentkv", "router"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
