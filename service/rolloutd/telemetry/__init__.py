"""OpenTelemetry adapters: SDK setup, the metric catalogue, and the observer that feeds them."""
