"""`dflash serve`: the HTTP server and its engine, the API dialects and the text conventions they parse."""
