"""Errors raised for configurations the plugin refuses."""


class OverlapConfigError(ValueError):
    """A flag, or a combination of flags and model settings, that the plugin cannot honour.

    ``flag`` names the command-line flag the user should change; the message says why and
    what would work instead.
    """

    def __init__(self, flag: str, message: str = None):
        if message is None:
            # Re-raised from its own text (Megatron's build_module does ``type(e)(f"{e} when
            # instantiating ...")``): "--flag: message ..." keeps its flag.
            text = flag
            flag = text.split(": ", 1)[0] if text.startswith("--") and ": " in text else None
            self.flag = flag
            super().__init__(text)
            return
        self.flag = flag
        super().__init__(f"{flag}: {message}")


class MegatronVersionError(RuntimeError):
    """The installed megatron-core is outside the range this plugin supports."""
