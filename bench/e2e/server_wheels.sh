# Sourced by run_device.sh and run_session.sh (device calls, from the repository root).
# server_wheels SITE: the server's dependencies the device lacks, installed into SITE from the
# wheels carried in .gpu/p6; the last two are for vLLM's own OpenAI server (its api_server
# imports model_hosting_container_standards, which the offline engine never needs).
server_wheels() {
  local site=$1
  for pair in pydantic_settings:pydantic_settings dotenv:python_dotenv boto3:boto3 \
    botocore:botocore s3transfer:s3transfer jmespath:jmespath rich:rich \
    markdown_it:markdown_it_py mdurl:mdurl httpx:httpx httpcore:httpcore h11:h11 anyio:anyio \
    dateutil:python_dateutil six:six urllib3:urllib3 yaml:pyyaml safetensors:safetensors \
    prometheus_client:prometheus_client redis:redis httptools:httptools \
    model_hosting_container_standards:model_hosting_container_standards supervisor:supervisor; do
    python3 -c "import ${pair%%:*}" 2>/dev/null || python3 -m pip install -q --no-index \
      --no-deps --target "$site" .gpu/p6/"${pair#*:}"-*.whl
  done
}
