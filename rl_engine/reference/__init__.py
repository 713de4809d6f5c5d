"""Float64 PyTorch references: the mathematical ground truth for accuracy.

Each operator family module defines ``<op>_f64`` (float64 result, for accuracy tests) and
registers ``<op>`` (same signature as the operator, result cast back to the input dtype) as the
diagnostic-policy fallback. References make no invariance promise.
"""
