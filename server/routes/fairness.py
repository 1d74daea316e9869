"""Who a request's caller is, for a Gateway's authorization filter: the endpoint picker's
fairness id (`x-llm-d-inference-fairness-id`), by which its flow control queues requests.

The picker reads that header from the request it routes, before loraplex sees the request, so
only the Gateway can set it; and only loraplex knows which tenant an API key belongs to. So the
Gateway asks here, as an HTTP external authorization service (Envoy's ext_authz; in Envoy
Gateway a SecurityPolicy with `extAuth.http`, `path: /auth/fairness` and `headersToBackend:
[x-llm-d-inference-fairness-id]`): it sends each request's headers to this prefix followed by
the request's own path, a valid key gets 200 with its tenant's id in the header, which the
Gateway writes over whatever the client sent, and anything else the 401 the request itself
would get, before it reaches the picker.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from loraplex.server.tenancy.deps import TenantDep

FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
AUTH_PREFIX = "/auth/fairness"

router = APIRouter(prefix=AUTH_PREFIX)

# ext_authz forwards the checked request's method.
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@router.api_route("{path:path}", methods=_METHODS, include_in_schema=False)
async def fairness_id(tenant: TenantDep) -> Response:
    return Response(status_code=200, headers={FAIRNESS_ID_HEADER: tenant.id})
