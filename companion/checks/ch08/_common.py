"""What several of chapter 08's checks share."""

_EXACT = {"rtol": 0.0, "atol": 0.0}      # a copy to the host and back changes no bit
