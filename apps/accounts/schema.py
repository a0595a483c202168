"""How the OpenAPI schema describes our two ways of authenticating."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "apps.accounts.authentication.ApiTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (`cp_...`), made on the Tokens API and shown once.",
        }


class BrowserSessionScheme(OpenApiAuthenticationExtension):
    target_class = "apps.accounts.authentication.BrowserSessionAuthentication"
    name = "cookieAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "cookie", "name": "sessionid"}
