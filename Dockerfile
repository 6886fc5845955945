# One image for every service; docker-compose.yml chooses the command of each (a replica
# container's: `python -m custody.replica`, its scheduler and executor together).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY custody custody
COPY services services
COPY shared shared
COPY protocol protocol
COPY fronts fronts
COPY kernels kernels
RUN pip install --no-cache-dir '.[executor]'
ENV CUSTODY_HOST=0.0.0.0
