"""Training-framework callbacks that report a run and its steps and epochs to the local agent.

    from wattwatch.sdk.integrations.transformers import WattwatchCallback      # Hugging Face Trainer
    from wattwatch.sdk.integrations.lightning import WattwatchCallback         # PyTorch Lightning

Each module imports its framework only when it is itself imported (``import wattwatch`` never does), and
still imports without it, so code and tests can use the callbacks with any object that has the hooks'
documented arguments.
"""
