"""The models a request can name: aliases and fallbacks (the YAML's and the live ones), the models the fleet serves or served."""
