def main(argv=None):
    print("mtpserve")
