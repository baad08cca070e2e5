"""`nemo_gym`: score with a NeMo Gym resources server's `POST /verify` (the user keeps their own verify()).

The scoring happens in the engine (workers.nemo_gym.engine.RemoteVerifyRun), over HTTP; this entry only
makes the name known to jobs and the command line. verifier_options: {"url": resources server} or
{"head_url": head server, "server": resources server name}.
"""
from .base import Verifier, register


@register
class NemoGymVerifier(Verifier):
    name = "nemo_gym"
    cpu_bound = False

    def verify(self, row, response_text, options):
        raise RuntimeError("the nemo_gym verifier calls a resources server's /verify from the engine; "
                           "it cannot score a bare response text")
