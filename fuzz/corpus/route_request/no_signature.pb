
req-6
