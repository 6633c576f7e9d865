"""placeholder"""
def add_parser(sub):
    sub.add_parser("info")
