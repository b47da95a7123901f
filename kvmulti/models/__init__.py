"""Small transformer models that run on the kvmulti API."""
