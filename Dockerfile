# fleetgate's image for compose.yaml: the gateway, the agents and the simulator.
# GPU workers build FROM an image with the engines (vLLM, LMDeploy) and add this repo
# the same way (see FLEETGATE_WORKER_IMAGE in compose.yaml).
FROM python:3.11-slim
WORKDIR /app
COPY . /app
# Editable, so config/ and scripts/ stay where the code looks for them.
RUN pip install --no-cache-dir -e /app
EXPOSE 8000
CMD ["python", "-m", "gateway", "--host", "0.0.0.0", "--port", "8000"]
